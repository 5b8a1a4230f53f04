# The jobs that use the volumes. Each group claims a volume with the access
# mode and read_only flag it needs; modeguard enforces them when Nomad
# publishes the volume to the group's node.

job "loader" {
  group "load" {
    volume "reference" {
      type            = "csi"
      source          = "reference"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
      read_only       = false
    }
    task "load" {
      driver = "exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "echo 'reference data' > /srv/reference/data.txt"]
      }
      volume_mount {
        volume      = "reference"
        destination = "/srv/reference"
      }
    }
  }
}

job "reader" {
  group "read" {
    volume "reference" {
      type            = "csi"
      source          = "reference"
      access_mode     = "single-node-reader-only"
      attachment_mode = "file-system"
      read_only       = true
    }
    task "read" {
      driver = "exec"
      config {
        command = "/bin/cat"
        args    = ["/srv/reference/data.txt"]
      }
      volume_mount {
        volume      = "reference"
        destination = "/srv/reference"
        read_only   = true
      }
    }
  }
}

job "journal-writer" {
  group "write" {
    volume "journal" {
      type            = "csi"
      source          = "journal"
      access_mode     = "multi-node-single-writer"
      attachment_mode = "block-device"
      read_only       = false
    }
    task "write" {
      driver = "exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "echo entry | dd of=/dev/journal conv=fsync"]
      }
      volume_mount {
        volume      = "journal"
        destination = "/dev/journal"
      }
    }
  }
}

job "journal-reader" {
  group "read" {
    count = 2
    volume "journal" {
      type            = "csi"
      source          = "journal"
      access_mode     = "multi-node-single-writer"
      attachment_mode = "block-device"
      read_only       = true
    }
    task "read" {
      driver = "exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "head -c 6 /dev/journal"]
      }
      volume_mount {
        volume      = "journal"
        destination = "/dev/journal"
        read_only   = true
      }
    }
  }
}
