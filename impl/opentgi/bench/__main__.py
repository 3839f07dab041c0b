from opentgi.bench.runner import main

main()
