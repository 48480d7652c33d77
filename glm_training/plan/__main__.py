"""`python -m glm_training.plan`: the memory plan of a config (`cli.py`)."""

from glm_training.plan.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
