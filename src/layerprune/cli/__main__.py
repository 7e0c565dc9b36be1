"""`python -m layerprune.cli ARGS` = `layerprune ARGS` (for `accelerate launch -m layerprune.cli recover ...`)."""

import sys

from layerprune.cli import main

if __name__ == "__main__":
    sys.exit(main())
