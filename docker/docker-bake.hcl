# Used together with the generated targets:  docker buildx bake -f docker/docker-bake.hcl -f bake.json <target>
# bake.json (attnkit matrix --format bake) holds one target per cell x variant; each inherits `_common` here
# for registry cache, provenance and SBOM attestations.
variable "CACHE_REPO" {
  default = "ghcr.io/attnkit/attnkit-cache"
}

variable "REVISION" {
  default = "unknown"
}

target "_common" {
  context    = "."
  dockerfile = "docker/Dockerfile"
  cache-from = ["type=registry,ref=${CACHE_REPO}:buildcache"]
  cache-to   = ["type=registry,ref=${CACHE_REPO}:buildcache,mode=max"]
  attest     = ["type=provenance,mode=max", "type=sbom"]
  args = {
    REVISION = "${REVISION}"
  }
}
