from lbproxy.cli import main

main()
