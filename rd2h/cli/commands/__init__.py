"""Subcommands of the ``rd2h`` command line, one module each (see ``rd2h.cli``)."""
