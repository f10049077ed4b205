from megasparse.cli import main

raise SystemExit(main())
