from solar_host.cli import main

raise SystemExit(main())
