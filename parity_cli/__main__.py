from parity_cli.cli import main

main()
