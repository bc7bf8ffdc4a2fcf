import sys

from raypipe.cli import main

sys.exit(main())
