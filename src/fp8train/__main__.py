import sys

from .train.commands.cli import main

sys.exit(main())
