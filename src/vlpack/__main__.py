from vlpack.cli import main

raise SystemExit(main())
