"""``python -m multipy.serve``: what ``multipy serve`` runs (through its launcher)."""
import sys

from .main import main

sys.exit(main())
