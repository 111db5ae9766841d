from sinkflow.cli import main

raise SystemExit(main())
