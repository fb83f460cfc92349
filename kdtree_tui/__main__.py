import sys

from kdspec.kdtree_tui.cli import main

sys.exit(main())
