import sys

from kvcached_serve.cli import main

sys.exit(main())
