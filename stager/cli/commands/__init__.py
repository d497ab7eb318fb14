"""One module per CLI command: ``add_parser``/``configure`` declare flags, ``run`` calls the
library."""
