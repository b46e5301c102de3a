"""A trained run's network as a distillation teacher file (body: vitpipe/tasks/make_teacher.py)."""

import sys

from vitpipe.commands import command

main = command("make_teacher")  # the command as `vitpipe make_teacher` runs it (vitpipe/commands.py)

if __name__ == "__main__":
    sys.exit(main())
