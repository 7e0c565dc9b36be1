"""`python -m layerprune.recover ARGS` = `layerprune recover ARGS` (for `accelerate launch -m layerprune.recover`)."""

import sys

from layerprune.cli import main

if __name__ == "__main__":
    sys.exit(main(["recover", *sys.argv[1:]]))
