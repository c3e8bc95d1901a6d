# Sourced by the device scripts: the n-gram example plugin registers through its entry point, and a dist-info on
# the path stands for an install (the GPU machine installs nothing from the tree).
mkdir -p /tmp/ngram_ep/deepinfer_ngram-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: deepinfer-ngram\nVersion: 0.1.0\n' > /tmp/ngram_ep/deepinfer_ngram-0.1.0.dist-info/METADATA
printf '[deepinfer]\nngram = deepinfer_ngram\n' > /tmp/ngram_ep/deepinfer_ngram-0.1.0.dist-info/entry_points.txt
export PYTHONPATH=$PWD:$PWD/plugins/deepinfer-ngram:/tmp/ngram_ep${PYTHONPATH:+:$PYTHONPATH}
