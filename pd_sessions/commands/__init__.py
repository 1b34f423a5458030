"""One module per pd-sessions subcommand (the CLI parses and dispatches)."""
