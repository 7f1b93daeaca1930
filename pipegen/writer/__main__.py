"""`python -m pipegen.writer output_dir=DIR`: the run's writer, alone or under the launcher."""

import sys

from pipegen.writer.process import main

sys.exit(main())
