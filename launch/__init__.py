"""Above the services: the `tandem` command line, the process and Ray launchers, and their security wiring."""
