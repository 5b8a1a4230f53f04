# Reference data: written once by a loader job, then read by one reader at a
# time with single-node-reader-only. modeguard keeps it to one node at a time
# and mounts it read-only (the loop device itself is read-only) for readers.
# Create with: nomad volume create reference.volume.hcl
id        = "reference"
name      = "reference"
type      = "csi"
plugin_id = "modeguard"

capacity_min = "64MiB"
capacity_max = "128MiB"

capability {
  access_mode     = "single-node-writer"
  attachment_mode = "file-system"
}

capability {
  access_mode     = "single-node-reader-only"
  attachment_mode = "file-system"
}

mount_options {
  fs_type = "ext4"
}

parameters {
  backend = "block"
}

topology_request {
  required {
    topology {
      segments {
        "topology.modeguard.csi.dev/zone" = "zone-a"
      }
    }
  }
}
