"""`python -m glm_training.priors`: see `glm_training/priors/cli.py`."""

from glm_training.priors.cli import main

raise SystemExit(main())
