"""The ``rd2h`` command line and the tooling behind it.

``main`` (the console script) builds the parser from ``rd2h.cli.commands``; the commands run
the demo (``rd2h.cli.demo``), the engine probe (``rd2h.cli.probe``, source processes through
``rd2h.cli.peer``) and the throughput benchmark (``rd2h.cli.benchmark``, its source processes
through ``rd2h.cli.bench_source``, its report through ``rd2h.cli.bench_report``).
Nothing here imports ``rd2h.testing``: the conformance suite may use these helpers, never the
other way round (an import-linter contract checks it).
"""
