from chatcli.entry import main

main()
