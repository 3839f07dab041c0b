from opentgi.bench.runner.runner import main

main()
