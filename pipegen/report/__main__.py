import sys

from pipegen.report.command import main

sys.exit(main())
