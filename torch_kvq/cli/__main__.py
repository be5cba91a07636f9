"""``python -m torch_kvq.cli``: what ``kvq demo --tp N`` re-runs on each torchrun rank."""

from torch_kvq.cli import main

raise SystemExit(main())
