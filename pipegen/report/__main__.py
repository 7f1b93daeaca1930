import sys

from pipegen.report.write import main

sys.exit(main())
