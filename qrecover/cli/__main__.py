"""``python -m qrecover.cli`` (and ``accelerate launch -m qrecover.cli recover ...``)."""

from . import main

main()
