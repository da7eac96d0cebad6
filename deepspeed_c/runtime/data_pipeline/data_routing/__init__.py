"""Random layerwise token dropping (random-LTD): its schedule, layer wrapper and token gather/scatter."""
