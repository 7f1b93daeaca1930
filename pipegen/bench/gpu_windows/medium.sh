#!/usr/bin/env bash
# The GPU bench's medium size in one lent-GPU window: see window.sh beside this file for the three device calls.
exec bash "$(dirname "${BASH_SOURCE[0]}")/window.sh" medium
