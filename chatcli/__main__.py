from chatcli.cli import main

main()
