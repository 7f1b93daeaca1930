"""`python -m pipegen.launch output_dir=DIR [key=value ...]`: generate trajectories (see --help)."""

import sys

from pipegen.launch.launcher import main

sys.exit(main())
