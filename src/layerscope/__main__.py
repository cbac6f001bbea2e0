import os
import sys

# `python -m layerscope` puts the working directory first on sys.path. Run in a checkout, that
# directory holds the source folders under their bare names (kernels/, engine/, ...), and `kernels`
# is also the PyPI package transformers >= 5.25 imports: the folder would shadow it. layerscope's own
# modules come from the installed package, so the working directory comes off the path.
if not sys.flags.safe_path and sys.path and os.path.abspath(sys.path[0] or ".") == os.getcwd():
    del sys.path[0]

from layerscope.cli import main  # noqa: E402

sys.exit(main())
