"""``python -m timlab`` (also what ``torchrun -m timlab train ...`` runs)."""

import sys

from timlab.cli import main

sys.exit(main())
