from chatcli.cli.entry import main

main()
