"""A trained run's network as a distillation teacher file (body: vitpipe/tasks/make_teacher.py)."""

import sys

from vitpipe.tasks.make_teacher import main

if __name__ == "__main__":
    sys.exit(main())
