"""`python -m glm_training.gpu_check`: see the package docstring."""

from glm_training.gpu_check.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
