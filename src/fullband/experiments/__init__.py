"""The experiments: what each of ``fullband quickstart`` and ``fullband experiment ...`` trains, measures and
reports (one module per experiment, :mod:`.common` what they share). Above training and analysis, below the
command line: :mod:`fullband.commands` parses the options and calls in; nothing here imports a command."""
