import sys

from layerscope.cli import main

sys.exit(main())
