"""`python -m opentgi.bench [flags]` runs the benchmark (runner.py); `python -m opentgi.bench
write-gguf OUT.gguf` writes the random Llama-1B-shaped GGUF of the llama.cpp comparison
(gguf_fixture.py); `python -m opentgi.bench kernels` times the linear kernels (kernels.py);
`python -m opentgi.bench images` is image-request throughput against transformers (baselines.py);
`python -m opentgi.bench --late-tenant` is the tenants comparison (http_load.py);
`python -m opentgi.bench embeddings` is `/v1/embeddings` against sentence-transformers (pooling/embeddings.py)."""

import sys

if sys.argv[1:2] == ["write-gguf"]:
    from opentgi.bench.gguf_fixture import main

    main(sys.argv[2:])
elif sys.argv[1:2] == ["images"]:
    from opentgi.bench.baselines import images_main

    images_main(sys.argv[2:])
elif sys.argv[1:2] == ["kernels"]:
    from opentgi.bench.kernels import main

    main(sys.argv[2:])
elif sys.argv[1:2] == ["embeddings"]:
    from opentgi.bench.pooling.embeddings import main

    main(sys.argv[2:])
else:
    from opentgi.bench.runner import main

    main()
