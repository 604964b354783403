from solar_host.cli.command import main

raise SystemExit(main())
