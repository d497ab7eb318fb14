"""``python -m stager COMMAND ...``"""

import sys

from stager.cli.main import main

sys.exit(main())
