from mgpu.cli import main

raise SystemExit(main())
