import os
import tempfile

import torch

torch.set_num_threads(1)

# One warm-start cache per test session: the smoke model is pretrained once, never downloaded.
os.environ.setdefault("TIMLAB_CACHE", tempfile.mkdtemp(prefix="timlab-test-cache-"))
