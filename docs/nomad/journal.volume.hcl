# A shared journal: one writer node, any number of reader nodes
# (multi-node-single-writer). On the block backend it is handed over as a
# raw device; modeguard refuses a second read/write attachment and attaches
# readers read-only. (For a shared filesystem instead, use backend = "nfs"
# and attachment_mode = "file-system".)
# Create with: nomad volume create journal.volume.hcl
id        = "journal"
name      = "journal"
type      = "csi"
plugin_id = "modeguard"

capacity_min = "64MiB"
capacity_max = "128MiB"

capability {
  access_mode     = "multi-node-single-writer"
  attachment_mode = "block-device"
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
