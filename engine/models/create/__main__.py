"""``python -m layerscope.engine.models.create OUT_DIR [--arch A] [--preset P] ...``"""

from layerscope.engine.models.create import main

raise SystemExit(main())
