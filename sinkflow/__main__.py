from sinkflow.cli import entry

entry()
