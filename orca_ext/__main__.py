"""`python -m orca_ext ...`: see orca_ext/cli.py."""
import sys

from .cli import main

sys.exit(main())
