"""python3 -m vlmgraph_client: see vlmgraph_client/cli.py."""
import sys

from .cli import main

sys.exit(main())
