import sys

from remesh.cli import main

sys.exit(main())
