"""The command's exit codes (see `solar-host --help`)."""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_AUTH = 4
# What a shell reports for a tool ended by SIGPIPE (128 + 13): the pipe's reader went away.
EXIT_BROKEN_PIPE = 141
