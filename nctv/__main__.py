"""`python -m nctv` is the `nctv` command."""
from nctv.cli import main

raise SystemExit(main())
