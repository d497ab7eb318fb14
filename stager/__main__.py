"""``python -m stager COMMAND ...``"""

import sys

from .cli import main

sys.exit(main())
